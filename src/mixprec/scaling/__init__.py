"""mixprec.scaling"""
