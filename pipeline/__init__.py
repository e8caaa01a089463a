"""pubcomp's cloud side: the ingest (broker -> landing zone) and the Spark jobs."""
