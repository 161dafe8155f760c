"""mixprec.diagnostics"""
