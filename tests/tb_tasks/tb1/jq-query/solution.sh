#!/bin/bash
jq -r '.users[] | select(.age >= 18) | .name' /data/users.json > /app/adults.txt
