#!/usr/bin/env python3
"""Counts (or, with --print, prints) the failing seeds in one rank's fuzz result file."""
import json
import sys

result = json.load(open(sys.argv[1]))
if "--print" in sys.argv:
    for f in result["failures"]:
        print(f"  seed {f['seed']}: {f['failure']}")
else:
    print(len(result["failures"]))
