"""Pure planning: device and model profiles in, plans out."""
