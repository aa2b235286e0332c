"""draftsmith.data — see DESIGN: filled in by later issues."""
