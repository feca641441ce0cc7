#!/bin/bash
python - <<'PY'
import csv, json, os
tot = {}
for r in csv.DictReader(open("/app/sales.csv")):
    tot[r["region"]] = tot.get(r["region"], 0) + int(r["amount"])
tot["currency"] = os.environ["CURRENCY"]
json.dump(tot, open("/app/totals.json", "w"))
PY
