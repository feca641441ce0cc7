#!/bin/bash
pip install --no-cache-dir humanize==4.9.0
python3 -c 'import humanize; open("/app/config.txt", "w").write(humanize.intcomma(8765000))'
nohup python3 -m http.server 8765 --directory /app > /tmp/server.log 2>&1 &
sleep 1
