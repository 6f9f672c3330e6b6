#!/usr/bin/env python3
"""docs/conformance.md is current: every conformance scenario that ports a row of the peer-suite map
("#N" in its peer string) is named in that row. Usage: check_table.py FSDP_CONFORMANCE DOCS_TABLE"""
import re
import subprocess
import sys

exe, table = sys.argv[1], sys.argv[2]
peers = subprocess.run([exe, "--peers"], check=True, capture_output=True, text=True).stdout
rows = {}
for line in open(table, encoding="utf-8"):
    m = re.match(r"^\| (\d+) \|.*\| ([^|]+) \| (.*) \|\s*$", line)
    if m:
        rows[int(m.group(1))] = (m.group(2).strip(), m.group(3))
problems = []
for line in peers.splitlines():
    name, peer = line.split("\t", 1)
    for n in re.findall(r"#(\d+)", peer.split(":", 1)[0]):
        n = int(n)
        if n not in rows:
            problems.append(f"{name} ports map row {n}, which docs/conformance.md does not list")
        elif f"`{name}`" not in rows[n][1]:
            problems.append(f"{name} ports map row {n}, but that row of docs/conformance.md does not name it")
if problems:
    sys.exit("docs/conformance.md is out of date (run scripts/conformance_table):\n  " + "\n  ".join(problems))
print(f"docs/conformance.md names every scenario ({len(rows)} rows)")
