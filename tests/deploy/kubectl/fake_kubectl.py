#!/usr/bin/env python3
"""A stand-in for kubectl that answers from recorded outputs (tests/deploy/test_k8s.py).

FAKE_KUBECTL names a JSON list of [regex, exit code, stdout]: the first regex that matches the
arguments (joined by spaces) answers; anything unrecorded exits 1, as kubectl does for an
unknown resource. Every call is appended to FAKE_KUBECTL_LOG.
"""

from __future__ import annotations

import json
import os
import re
import sys

args = " ".join(sys.argv[1:])
with open(os.environ["FAKE_KUBECTL_LOG"], "a") as log:
    log.write(args + "\n")
with open(os.environ["FAKE_KUBECTL"]) as recorded:
    answers = json.load(recorded)
for pattern, code, stdout in answers:
    if re.search(pattern, args):
        sys.stdout.write(stdout)
        sys.exit(code)
sys.stderr.write(f"error: the server doesn't have a resource for: {args}\n")
sys.exit(1)
