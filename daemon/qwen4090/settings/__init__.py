"""Every setting's default and its validation; the keys whose default follows others."""
