"""One module per run kind (deposit, graft, probe, matrix, replay, score): each ties engine, store, ledger and eval together for one command and writes its ledger entry."""
