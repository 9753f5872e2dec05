"""Several processes: the launcher's variables, the ranks and their agreements."""
