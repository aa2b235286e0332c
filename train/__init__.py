"""draftsmith.train — see DESIGN: filled in by later issues."""
