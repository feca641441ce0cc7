#!/bin/bash
cat /srv/inbox/* | wc -w > /app/total.txt
