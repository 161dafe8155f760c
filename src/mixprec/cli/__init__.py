"""mixprec.cli"""
