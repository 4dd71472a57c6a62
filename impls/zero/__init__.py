"""ZeRO (Rajbhandari et al. 2020): the unit layout (``layout``), the shared base of the three
stages (``base``), stages 1 and 2 with replicated parameters (``replicated``), stage 3 with
sharded parameters (``sharded``), and what they predict (``prediction``)."""
