"""mixprec.precision"""
