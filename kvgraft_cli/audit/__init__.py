"""Re-checking a ledger without torch or a GPU: ``kvgraft verify`` and its cache of verified file hashes. Never imports the engine or runs."""
