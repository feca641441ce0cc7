#!/bin/bash
awk '{print $9}' /app/access_log | sort | uniq -c | awk '{print $2, $1}' > "/app/$REPORT_NAME"
python -c "import csv; print('items', sum(int(r['qty']) for r in csv.DictReader(open('/tmp/warehouse/items.csv'))))" >> "/app/$REPORT_NAME"
