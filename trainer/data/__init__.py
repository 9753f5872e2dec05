"""The data both loops read (the trainer's own and a user's through `recovery.KeyedData`): the
keyed batch order, keyed fetching, streams and their cursors, the sample ledger (docs/streaming.md)."""
