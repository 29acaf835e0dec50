"""--explain: every figure the three planners print, its derivation and where it comes from."""

MEMORY = """\
memory planner: every figure is GiB (2^30 bytes) per GPU; Psi = the preset's quoted parameters.

state     mixed-precision Adam keeps 2 + 2 + 12 = 16 bytes per parameter: bf16 weights (2),
          bf16 gradients (2), fp32 master, Adam m and v (4 + 4 + 4) - ZeRO, Rajbhandari et al.
          2020, arXiv:1910.02054, section 3.1 ("2 Psi + 2 Psi + K Psi", K = 12).
          A model-parallel rank owns Psi_r = Psi / (tp pp); over dp data-parallel ranks:
            ZeRO-0 (DDP)  16 Psi_r
            ZeRO-1        4 Psi_r + 12 Psi_r / dp        (optimizer sharded)
            ZeRO-2        2 Psi_r + 14 Psi_r / dp        (+ gradients sharded)
            ZeRO-3        16 Psi_r / dp + 4 Psi / (tp L) (+ parameters sharded), the extra term
                          being one layer's unsharded bf16 parameters and gradients in flight
                          (FSDP, Zhao et al. 2023, arXiv:2304.11277: "fully sharded" is never zero
                          resident parameters). 70B on 8 GPUs: 130.4 + 3.3 = 133.6 GiB.
activ     Korthikanti et al. 2022, arXiv:2205.05198, eq. 1, 16-bit activations with dropout:
            per layer s b h (34 + 5 a s / h)  (the 5 a s / h is the a s^2 softmax and its mask)
          tp > 1 always with sequence parallelism (eq. 4): s b h (34 / t + 5 a s / (h t))
          selective recompute (section 4.2) drops the attention term: 34 s b h / t
          full recompute (Chen et al. 2016, arXiv:1604.06174) keeps the layer input: 2 s b h / t
          times L layers. Pipeline parallelism does not divide it: under 1F1B (PipeDream,
          arXiv:1806.03377) the first stage holds pp micro-batches of L / pp layers (eq. 5).
reserve   a fixed framework / fragmentation allowance (--reserve, default 10 GiB).
total     state + activ + reserve; fits when total <= --gpu-mem (default 192 GiB, an MI300X).
--suggest every layout dp x tp x pp = gpus with tp a power of two <= 8 (one node) dividing the
          heads, KV heads and d_ff, pp dividing L, ZeRO 0-3, recompute none/selective/full; the
          fitting ones sorted by a heuristic disruption score (stable, ties in that order):
            zero stage + {none 0, selective 3, full 6} + 4 log2(tp) + 4 log2(pp)
          ("prefer ZeRO stages over recompute over TP / PP"); the first --top taken and a plan
          whose figures repeat an earlier one's dropped (it adds an axis that buys nothing).
this model the same layout priced exactly for this project's GPT block at the preset's shape
          (emulator.config.param_shapes; parallel.data.cost's ZeRO formulas with the flat
          buffers' padding; emulator.flops.activation_bytes_per_block), with why it differs.
"""

COLLECTIVE = """\
collective cost model: a ring all-reduce of S bytes over P ranks (Patarasuk & Yuan 2009;
Horovod, Sergeev & Del Balso 2018, arXiv:1802.05799).
bytes/rank  reduce-scatter then all-gather, P-1 steps of S/P each: 2 (P-1)/P S
time        T = 2 (P-1) alpha + 2 (P-1)/P S / B        (alpha --latency in us, B --bw in GB/s)
S*          the two terms equal: alpha = S / (P B), S* = P alpha B; below it latency-bound
latency %   2 (P-1) alpha / T
busbw       S / T x 2 (P-1)/P: nccl-tests' bus bandwidth (docs/PERFORMANCE.md of nccl-tests),
            comparable with the link speed
DDP         the gradient of --params billion parameters at --grad-bytes each, one all-reduce;
            fraction = T / --step-ms: > 100% COMMUNICATION-BOUND; > 2/3 (the backward pass, 2 of
            the 3 forward-equivalents, is all a gradient sync can overlap) EXPOSED; else hideable
bucketing   c = ceil(G / bucket) all-reduces: T = 2 (P-1) alpha c + 2 (P-1)/P G / B (the last
            bucket is partial); overlap? = c >= 2 (one bucket can only start after the whole
            backward); bandwidth-bound? = bucket >= S*. DDP's default bucket is 25 MB (Li et al.
            2020, arXiv:2006.15704)
layer ratio one layer's 12 h^2 parameters: 6 N s b x grad-accum FLOPs at --tflops against one
            all-reduce of its 2-byte gradient; hideable when the ratio < 2/3
"""

BUBBLE = """\
pipeline bubble: S balanced stages, M micro-batches, v chunks per device, free point-to-point.
total       (M + (S-1)/v) t for stage time t per micro-batch (GPipe, arXiv:1811.06965; 1F1B,
            arXiv:1806.03377; interleaved 1F1B, Narayanan et al. 2021, arXiv:2104.04473 2.2.2)
bubble      ((S-1)/v) / (M + (S-1)/v)          efficiency  M / (M + (S-1)/v)
M needed    least M with efficiency >= E: M >= E (S-1) / (v (1-E)), computed exactly
in flight   1F1B's first stage holds min(S, M) micro-batches of activations
sweep       efficiency for S in 2..32 and M in 1..128, rounded half to even
"""
