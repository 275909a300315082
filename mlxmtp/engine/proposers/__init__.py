"""Draft sources behind one interface (base.py: `Proposer`, `Drafts`).

base.py, the interface and what exactness asks of a drafter; mtp.py, the MTP head
(`MTPProposer`) over mtp_head.py (the head's passes and chained drafts) and mtp_inputs.py
(its pending inputs between cycles); build.py, which drafter an engine runs. Adding a
drafter: one module implementing `Proposer`, and its line in build.py.

Nothing is imported here: state.py imports mtp_head.py, and mtp.py imports state.py.
"""
