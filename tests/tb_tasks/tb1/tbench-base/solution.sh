#!/bin/bash
set -euo pipefail
echo ready > report.txt
python3 -c 'import tomli_w; open("status.toml", "w").write(tomli_w.dumps({"status": "ready"}))'
