"""Time limits of the tests' subprocesses and process groups, derived from CI's budget.

A limit exists to turn a hang into a failure, not to measure speed: the CPU suite runs on 2 shared
cores, where a Triton-interpreter subprocess that takes 2 minutes on a quiet machine has been seen
to take over 10 under load. So every limit is the whole of CI's test budget less its install time,
never a per-machine guess: a loaded machine finishes late, a hung child still fails the suite.
"""
from __future__ import annotations

import datetime

CI_BUDGET_S = 90 * 60  # CI's limit for install + the CPU suite + the verl tests (2 cores)
SUBPROCESS_TIMEOUT_S = 3000  # CI_BUDGET_S less ~40 minutes of installs and the rest of the suite
# A gloo group waits this long for a peer rank. A rank that raises ends its siblings at once (mp.spawn
# terminates them), so this only bounds a rank that is alive but slow: the same budget applies.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=SUBPROCESS_TIMEOUT_S)
