"""The depth policy: how many drafts each cycle verifies (0: plain decoding).

`base.py` is the interface the engine calls; `adaptive.py` the policy that maximises tokens
per second from what cycles cost (`cycle_costs.py`, measured at start-up by
`calibration.py`) and how likely drafts are kept (`acceptance.py`), measuring other depths
now and then (`probes.py`); its knobs and the reasons it gives are in `config.py`."""
