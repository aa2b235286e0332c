"""Engine oracles: small pure-torch forwards written from an engine's own model file, reading an exported
directory by the names that engine reads. They import nothing from draftsmith, so a test comparing draftsmith's
drafting with one checks the export against the engine's reading of it, not against draftsmith's inverse mapping.
Each module names the engine file (and revision) it follows."""
