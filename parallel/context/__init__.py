"""Context parallelism: every sequence split over the cp ranks; attention by a K/V ring (ring
attention), an all-gather of K and V (Llama 3), or an all-to-all over heads (DeepSpeed-Ulysses).

  layout.py     which global positions each cp rank holds: contiguous or zigzag
  core.py       attention of a query block on a key block, masked by global positions
  ring.py       ring attention: K/V blocks around the ring, online-softmax merge, dK/dV home
  allgather.py  all-gather K and V before attention, reduce-scatter dK and dV after
  ulysses.py    all-to-all sequence-sharded <-> head-sharded around the single-rank attention
  attention.py  cp_attention_forward / cp_attention_backward: one interface for the three
  cost.py       bytes per rank per layer, forward and backward, and cache bytes, in closed form
  work.py       the attention work each rank does per ring step, balanced or not, in closed form
  train.py      cp_train: cp (x dp) training, one DDP over dp x cp
"""
