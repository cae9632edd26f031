"""The copies into the slots: those the graph's ops ask for (:mod:`.slot_copies`), those the
call hook begins at a call's entry (:mod:`.hook_copies`), and where each call's circular
prefetch starts (:mod:`.circular`)."""
