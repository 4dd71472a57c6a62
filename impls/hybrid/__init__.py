"""Every axis at once: the hybrid scheme (``scheme``) and its stage model (``model``)."""
