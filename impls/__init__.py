"""Native implementations of every scheme; each module registers its schemes on import."""
