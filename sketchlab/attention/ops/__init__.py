"""The attention mechanisms' operations, one home each (issue 40, fla's ``ops/`` layout): so far
:mod:`.hybrid`, the hybrid combine every torch path shares."""
