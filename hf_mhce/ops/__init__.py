"""Pure tensor math: the vocabulary sweeps of fused (multi-head) cross-entropy.

No autograd and no argument checking here (see ``hf_mhce.losses``).  Two interchangeable
implementations with the same signatures:

- ``torch_sweep``: chunked torch, any device, memory bounded by ``HF_MHCE_CHUNK_MB``;
- ``triton_forward`` / ``triton_backward``: Triton kernels for CUDA (or CPU under
  ``TRITON_INTERPRET=1``), imported lazily (triton is a dependency on Linux only, and its import is slow);
- ``triton_forward_grad``: the Triton backend's forward that also computes the gradients of a mean or
  summed loss (statistics and gradients in one pass over the logits).

``torch_logprobs`` gives the mixture log-probabilities log pbar [N, V] (the model's output under MHCE)
on the torch sweeps.  ``mixture`` turns the per-head statistics into losses and gradient coefficients; ``budget`` reads the
memory budgets (``HF_MHCE_CHUNK_MB``, ``HF_MHCE_WORKSPACE_MB``) for both, and ``HF_MHCE_GRAD_IN_FORWARD``.
Conventions: hidden [N, D] and weight [V, D] contiguous, labels [N] int64 with -1 for ignored
tokens, per-head statistics [N, H] in the compute dtype (float32; float64 on the torch path for
float64 inputs).  An optional ``low_rank`` pair (U [N, H, R], B [V, R]), contiguous and in hidden's
dtype, adds U_h B^T to head h's logits (LoRA on the head).
"""
