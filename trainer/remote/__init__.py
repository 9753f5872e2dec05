"""The run directory in an object store (s3://, gs://, az://): URLs, objects, the commit
protocol for sealed directories, and the single-writer lease."""
