"""One model over several ranks: rank 0's replicating runner proxy, the followers' replay, and rank 0's watch."""
