"""Recovery generations: atomic publish, manifests and verification, resume selection,
writing and restoring training state with torch.distributed.checkpoint."""
