"""Child process that runs math-verify for `stapo_trl.rewards.math_verify`, started as a script (it imports nothing
from the parent program). One JSON request per line on stdin (``{"gold", "prediction", "timeout"}``), one JSON
`Verdict` per line on stdout; each request is bounded by SIGALRM in the child's main thread."""

import json
import logging
import os
import signal
import sys
from functools import lru_cache

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]


class _Deadline(BaseException):
    """Raised by SIGALRM; a BaseException, which math-verify's `except Exception` blocks do not swallow."""


def _on_alarm(signum, frame):
    raise _Deadline()


def main():
    try:
        from math_verify import parse, verify
    except Exception as error:  # reported to the parent, which raises it with the install hint
        print(json.dumps({"ready": False, "error": f"{type(error).__name__}: {error}"}), flush=True)
        return 1
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    signal.signal(signal.SIGALRM, _on_alarm)

    @lru_cache(maxsize=4096)
    def parse_gold(gold):
        wrapped = gold if "\\boxed" in gold or "$" in gold else "\\boxed{" + gold + "}"
        return parse(wrapped, parsing_timeout=None, raise_on_error=True)

    def judge(request):
        stage = "gold"
        signal.setitimer(signal.ITIMER_REAL, max(float(request["timeout"]), 1e-3))
        try:
            gold = parse_gold(request["gold"])
            if not gold:
                return {"verdict": "gold_unparsable", "stage": stage}
            stage = "prediction"
            prediction = parse(request["prediction"], parsing_timeout=None, raise_on_error=True)
            if not prediction:
                return {"verdict": "no_answer", "stage": stage}
            stage = "verify"
            correct = verify(gold, prediction, timeout_seconds=None, raise_on_error=True)
            return {"verdict": "correct" if correct else "incorrect", "stage": stage, "parsed": str(prediction[-1])}
        except _Deadline:
            return {"verdict": "timeout", "stage": stage}
        except Exception as error:
            return {"verdict": "error", "stage": stage, "detail": f"{type(error).__name__}: {error}"[:500]}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            verdict = judge(json.loads(line))
        except _Deadline:
            verdict = {"verdict": "timeout", "stage": "verify"}
        print(json.dumps(verdict), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
