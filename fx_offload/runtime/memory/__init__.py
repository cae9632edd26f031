"""Where an offloaded model's bytes live: page-locked host blocks (:mod:`.host_memory`), the
device slots and the record of what they hold (:mod:`.slots`, :mod:`.contents`), compressed
host copies and their checks (:mod:`.compressed`, :mod:`.compressed_layers`,
:mod:`.record_check`, :mod:`.file_backed`), and the opt-in slot check (:mod:`.slot_check`)."""
