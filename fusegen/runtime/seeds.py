"""The eager seeds' two numbers, one owner for both sides that draw them: runtime.dropout's
batches (a process without the C++ extension) and the extension's (runtime.native passes
them to it when it loads)."""

SEED_LIMIT = 2**63  # seeds live in an int64 tensor: 0 <= seed < 2**63
SEED_BATCH = 256  # seeds drawn at once for eager calls, per device
