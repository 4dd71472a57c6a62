"""The context (sequence) parallel family: the sequence of every sample sharded over the cp
ranks, each rank holding the whole model.

``layout`` says which tokens a rank holds (contiguous, zig-zag, striped; USP's 2-D split);
``kernels`` is the blockwise attention kernel (output and log-sum-exp, and its backward) and
the online-softmax merge; ``ring`` (Liu et al.'s Ring Attention), ``rsa`` (Li et al.'s Ring
Self-Attention), ``ulysses`` (DeepSpeed-Ulysses and USP) and ``allgather`` (Llama 3) are the
distributed attention cores; ``base`` runs the model on a sequence shard and reduces the
gradients over dp x cp; ``schemes`` registers them. Closed forms: ``parbench.analytic.context``.
"""
