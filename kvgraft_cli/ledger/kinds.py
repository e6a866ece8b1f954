"""The kinds of ledger entries, named once: what each line's ``kind`` field holds, for the commands that write
lines and for everything that reads them (the verifier, replay, the report, ``ledger log``). Plain strings, so a
line's canonical bytes are what they always were; the schema (schemas/ledger-entry.schema.json) says which fields
each kind carries."""

from __future__ import annotations

DEPOSIT = "deposit"  # a problem's prefix prefilled, stored and recorded (`kvgraft deposit`, solve --deposit-verified)
GRAFT = "graft"  # an artifact restored and decoded after (`kvgraft graft`)
GRAFT_CHECK = "graft-check"  # graft against fresh, byte for byte (`kvgraft graft --check`)
PROBE = "probe"  # an artifact grafted at other positions (`kvgraft probe`)
SOLVE = "solve"  # one problem answered, with or without the library (`kvgraft solve`)
SOLVE_OUTPUTS = "solve-outputs"  # a solve run's outputs file, once every problem is recorded
SCORE = "score"  # an outputs file graded (`kvgraft score`)
SERVE = "serve"  # one request `kvgraft serve` answered
REGISTER = "register"  # a pre-registration's hash, before anything ran (`kvgraft replay --register`)
REPLAY = "replay"  # a pre-registration replayed and compared (`kvgraft replay`)
REPLAY_SERVED = "replay-served"  # a served ledger computed again (`kvgraft replay --served`)
IMPORT = "import"  # a bundle's artifacts stored here (`kvgraft store import`)
