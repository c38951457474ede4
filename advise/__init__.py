"""`ssdmoe advise`: the best way to run a model on a machine, searched with the simulator.

A candidate is an engine configuration in the engine's own words (decode path, lead, K, hot
pool, staged headroom, readers, cache policy: `space`); it becomes a simulator scenario
through the same mapping `sim compare` replays a captured run with (`predict`), on the
hardware profile and emulated-machine settings given (`machine`). `search` runs the grid
(exhaustive, or a coordinate search when it is large), `frontier` keeps the best per K and
picks one, naming the resource that binds it, and `report` prints, writes JSON and plots.
No MLX anywhere here: a search needs no model weights, only the manifest or a model profile.
"""
