"""Expert parallelism: the MoE block with its experts split over an ep group, tokens moved by
all-to-all(v). dispatch.py moves rows, layer.py is the block (forward / backward), cost.py the
bytes in closed form, load.py the load table (routed / kept / dropped per expert)."""
