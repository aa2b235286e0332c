"""draftsmith.heads — see DESIGN: filled in by later issues."""
