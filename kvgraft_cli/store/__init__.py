"""Where artifacts live: a content-addressed object store with a SQLite index from problem/prefix keys to artifacts."""
