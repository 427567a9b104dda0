cv('a GBM F15', F, gbm)
cv_multi('a2 LR F15', None, [('lrF', F, 'lr')])
cv('c1 GBM F15+extra21', FE, gbm)
