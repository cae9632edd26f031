"""Who holds the true weights, call by call, and what the user did to them: the ownership
rule (:mod:`.ownership`), version counters and the cheap per-call test (:mod:`.versions`,
:mod:`.fingerprint`), new values and writes during a call (:mod:`.new_values`,
:mod:`.in_call`), and the public weights API (:mod:`.weights`)."""
