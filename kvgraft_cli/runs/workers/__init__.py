"""Where a run's pieces execute: ``local`` runs a job in a fresh child process (a kernel-flag profile needs its own
process, since the flags are read when torch is imported). Workers return structured records, errors included,
never text for the parent to parse."""
