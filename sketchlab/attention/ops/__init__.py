"""The attention mechanisms' operations, one home each (issue 40, fla's ``ops/`` layout): :mod:`.additive`,
:mod:`.decayed`, :mod:`.delta` and :mod:`.cache` (each with its ``naive``, ``chunk`` and, where split out, its
decoding step), and :mod:`.hybrid`, the hybrid combine every unfused torch path shares (DESIGN §2)."""
