cv_multi('c2 LR(PV idf-pool) -> GBM', F, [('lrPVI', pv('idfpool'), 'lr')])
cv_multi('c3 LR(PV max-pool) -> GBM', F, [('lrPVM', pv('maxpool'), 'lr')])
cv_multi('c4 LR(unmatched static) -> GBM', F, [('lrDS', np.concatenate([sym3('unm_static'), CNT], 1), 'lr')])
cv_multi('c5 LR(unmatched ctx) -> GBM', F, [('lrDC', np.concatenate([sym3('unm_ctx'), CNT], 1), 'lr')])
cv_multi('c6 LR(bilinear PCA48) -> GBM', F, [('lrBIL', bil(), 'lr')])
cv_multi('c7 LR(static PV) -> GBM', F, [('lrSPV', SPV, 'lr')])

