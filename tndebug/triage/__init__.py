"""`tndebug triage`: diagnose a checkpoint, and the user's own model code, without training.

    from tndebug.triage import TriageOptions, triage
    report = triage(TriageOptions("model.pt", model="mymodel.py:make_model", adapter="annotated"))

loading.py (safe loading) -> layouts.py (known layouts -> tndebug's model) or adapters.py (the
user's code) + capture.py (a Trace from any model) -> hygiene.py (checkpoint checks) -> run.py.
"""
from tndebug.triage.run import TRIAGE_PROBES, TriageOptions, triage

__all__ = ["TRIAGE_PROBES", "TriageOptions", "triage"]
