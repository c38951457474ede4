"""What every layer of ssdmoe may import and that imports nothing of ours: today the error types
(contract.errors). The engine, the simulator, the traces and the CLI all point here."""
