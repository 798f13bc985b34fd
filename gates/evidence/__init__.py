"""Evidence bundles: the schema and crash-safe writing (bundle.py), signing (signing.py), reading them back
(verify.py), the reports and their templates (report.py, plots.py, templates/), the index (index.py).

Not here: what the gates judge (gates.core, gates.checks); this package records, checks and shows it.
"""
