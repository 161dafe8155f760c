"""mixprec.bench"""
