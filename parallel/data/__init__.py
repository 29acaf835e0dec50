"""Data parallelism: DDP buckets and no_sync; ZeRO-1/2/3 on one code path; FSDP units."""
