M = (U + V); M = M / np.linalg.norm(M, axis=1, keepdims=True)
cv_multi('e2 topic-only LR(dir(u+v)) -> GBM', F, [('lrTOPd', M, 'lr')])
cv_multi('e3 topic-only LR(dir(u+v), dir^2) -> GBM', F, [('lrTOPd2', np.concatenate([M, M ** 2], 1), 'lr')])
