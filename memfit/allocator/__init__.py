"""The caching allocator, modelled: its block rules (``model``), the layout rebuilt from a snapshot's
trace (``layout``), snapshot reading (``snapshot``), what-if replay under other settings (``whatif``),
and the allocator-conf strings PyTorch reads (``conf``)."""
