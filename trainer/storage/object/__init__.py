"""A run directory in an object store: the client, the commit without rename, the lease, tiering."""
